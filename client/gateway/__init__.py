"""The OpenAI-compatible HTTP gateway: a separate process, a client of the daemon through the async SDK,
that speaks OpenAI's HTTP API outside and ember's protocol inside (`ember gateway`, `ember serve --http`).
It never imports the kernels. docs/gateway.md has the usage, the metrics and the measurements.

  config.py               where it listens, its key, its bounds; exposure refused without a key
  server.py               the process: listen (aiohttp on uvloop), serve, stop gracefully
  app.py                  routes, API key, body limit, errors in OpenAI's format, request counter
  openai_schema.py        OpenAI's request and response bodies as msgspec Structs
  request_translation.py  an OpenAI request -> the Generate it asks for, or a 400 naming the field
  generation.py           one request carried through the daemon: whole or streamed, cancelled if the client goes
  response_format.py      chat and text completions, whole and as server-sent events
  token_texts.py          token ids -> texts for logprobs (cached Detokenize)
  connection_pool.py      the daemon connections shared by all requests, and the bound on requests in flight
  metrics.py              /metrics: the gateway's counters and histograms, the daemon's StatsReport
  errors.py               ApiError and the mapping from the SDK's exceptions to HTTP statuses
  serve_child.py          `ember serve --http`: the gateway as the daemon's child process
"""
