"""`posttrain serve`: a generation server that runs anywhere, CPU included (app.py, its routes in routes.py), over the
transformers engine (engine.py), with weights sent as checked safetensors buckets (posttrain/wire.py, the protocol
shared with the trainer's client, generation/server.py). docs/generation.md describes the protocol and its
guarantees.

Imports go one way: serving imports generation (its protocol, and the transformers backend the engine samples with)
and posttrain/wire.py; generation imports nothing of serving."""
