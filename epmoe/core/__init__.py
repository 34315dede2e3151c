"""Core utilities shared by every other package: errors, process-group helpers, device facts.

Nothing here imports from the rest of epmoe.
"""
