"""prime_ac inside the trainers that use it: small adapters, one module per framework.

Each module imports its framework only when one of its functions is called, so
``import prime_ac.integrations.torchtitan`` works (and ``import prime_ac`` loads torch only)
without torchtitan, transformers or FastVideo installed. docs/integrations.md has an example per
adapter.
"""
