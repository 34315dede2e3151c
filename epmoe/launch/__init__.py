"""`python -m epmoe.launch` / `torchrun -m epmoe.launch`: run an EP MoE layer on synthetic weights.

Modules: `cli` (flags and the main loop), `env` (process groups from torchrun / mpirun / single
process), `presets` (HF config dicts), `synthetic` (synthetic checkpoints in HF naming).
"""
