"""The per-node plan: what each engine will hold, from the requests placed on it."""
