"""Adapters that let a serving engine ask kvpolicy instead of its own hard-coded layout logic.

Each adapter reads the engine's objects by attribute name (duck typing) and
imports nothing from the engine itself, so kvpolicy installs and tests
without it. `kvpolicy.engine.integrations.vllm` replaces vLLM's ``use_uniform_kv_cache``.
"""
