"""The nightly suite a CI job runs: `python -m epmoe.nightly` (docs/nightly.md).

Modules: `cli` (plans the steps for this machine, runs them, gates, reports), `steps` (a step is a
subprocess with a time limit; the runner prints progress and kills hung steps with their children),
`baseline` (figures, baseline files, the regression gate; pure logic), `report` (JUnit XML, JSON,
table, plot), `worker` (the multi-rank check and benchmark started under torchrun).

Imports: `nightly` sits above `launch`; only `worker` imports the layer, inside the step processes.
"""
