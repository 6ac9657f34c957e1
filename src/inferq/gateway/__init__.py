"""``inferq gateway``: the OpenAI HTTP API in front of the queue, so any language can use it.

- :mod:`~inferq.gateway.openai_api`: OpenAI request bodies -> submissions, results and
  chunks -> OpenAI response bodies, the OpenAI error body (no I/O).
- :mod:`~inferq.gateway.tenants`: bearer API keys -> tenants, allowed and default classes,
  rate limits (a keys file, TOML or JSON).
- :mod:`~inferq.gateway.ratelimit`: requests and tokens per minute per tenant (``limits``,
  Redis storage, so every replica shares the counts).
- :mod:`~inferq.gateway.app`: the Starlette application (SSE through ``sse-starlette``),
  run by uvicorn. Stateless: any number of replicas.

Needs the ``gateway`` extra (``pip install 'inferq[gateway]'``).
"""
