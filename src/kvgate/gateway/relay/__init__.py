"""The relay: admit a request, pick a backend, forward it, stream the answer back; and the
upstream pool and model catalog it forwards through."""
