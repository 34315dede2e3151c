"""Integrations of epmoe into other libraries. Each submodule imports its library itself; importing
`epmoe` or `epmoe.integrations` imports none of them.

    epmoe.integrations.transformers   Hugging Face transformers 5 MoE models, expert-parallel
                                      (`pip install 'epmoe[hf]'`)
"""
