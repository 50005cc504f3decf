"""prime_ac inside the trainers that use it: small adapters, one module per framework.

Each module imports its framework only when one of its functions is called, so
``import prime_ac.integrations.torchtitan`` works (and ``import prime_ac`` loads torch only)
without torchtitan, transformers or FastVideo installed. An adapter that reads its trainer's
config tables registers its reader with :mod:`prime_ac.tables`, and marks the targets it builds
for the user as :func:`prime_ac.tables.supplied`. docs/integrations.md has an example per adapter.
"""
