"""The processes kvgate starts and supervises.

- `children`: a child dies with the process that started it, and is stopped politely,
  then firmly (alone or with its process group).
- `workers`: `kvgate serve --workers N`, N gateway processes on one SO_REUSEPORT port
  sharing one store, restarted when they die.
- `redis_server`: a private `redis-server` child (for `--workers` without a store, tests
  and benchmarks).
- `ports`: free ports on 127.0.0.1 for the servers started.
"""
