"""One module per KV connector class the plugin guards: each a ``guard(connector, stamp, unstamped)``.

`kvpolicy.engine.integrations.vllm_exchange.GUARDS` maps a connector class to its module here.
"""
