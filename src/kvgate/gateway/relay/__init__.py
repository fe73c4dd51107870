"""The relay: read a request, admit it, forward it to a backend and relay the answer back.

`relay.py` runs one request's life and writes its access line; `intake.py` reads and costs
the request, `admitting.py` waits for the core's admission and retries, `streaming.py`
relays the answer; `call.py` holds the request's objects, `upstream.py` the engines'
connections and model catalog, `context.py` the engines' context-length refusals and
`recost.py` the re-costing of waiting requests when a better count of their prompts
arrives. Counting prompts is kvgate.gateway.tokens.
"""
