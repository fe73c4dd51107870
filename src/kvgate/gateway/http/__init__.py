"""The HTTP layer: the servers and their connection guard, the ASGI types, the request-body
reader, the upstream HTTP/1.1 client, OpenAI-shaped errors, and how a request learns its
client left (cancel scopes, disconnect signals, spliced streams)."""
