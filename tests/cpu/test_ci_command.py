"""CI runs what the README tells a user to run: `.ci/run`'s command is the README's test command."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = [l for l in (REPO / ".ci" / "run").read_text().splitlines()
                if l.strip() and not l.startswith(("#", "set ", "cd "))]
    assert len(commands) == 1, commands
    assert f"```bash\n{commands[0]}\n```" in readme, commands[0]
    assert "python -m pytest tests" in commands[0] and "[test,mpi]" in commands[0] and "openmpi-bin" in commands[0]
