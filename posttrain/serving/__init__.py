"""`posttrain serve`: a generation server that runs anywhere, CPU included (app.py), over the transformers engine
(engine.py), with weights sent as checked safetensors buckets (wire.py). The trainer's client is
generation/server.py. docs/generation.md describes the protocol and its guarantees."""
