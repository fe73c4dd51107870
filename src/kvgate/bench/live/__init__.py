"""The live benchmark: real processes (kvgate, the simulator or the real vLLM engine) and
real clients on loopback, in wall-clock time.

- `run`: one run (`run_live`, `LiveOptions`) and its accounting (zombie tokens);
- `client`: the clients and what their tasks share;
- `poll`: what is read of the engines and the gateway while a run plays;
- `driver`: starting and stopping what a run talks to (the live simulator, the real engine,
  the gateway).
"""
