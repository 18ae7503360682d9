"""Generation: the `Generator` protocol, its outputs, and the backends behind it.

A backend turns tokenised prompts into sampled completions. The trainer sees only this protocol;
which engine runs underneath (transformers in-process, or a generation server: generation/server.py) is chosen at
setup by `make_generator`.

    protocol.py     SamplingParams, Rollouts, Generator, GenerationError: imports no backend
    factory.py      make_generator: imports the chosen backend when called
    the backends    transformers_backend.py (with lean_decoder.py, sampling.py), server.py (with vllm_transfer.py),
                    vllm_colocate.py (with vllm_compat.py): each imports protocol.py, never this package's __init__
"""

from posttrain.generation.factory import make_generator
from posttrain.generation.protocol import GenerationError, Generator, Rollouts, SamplingParams

__all__ = ["GenerationError", "Generator", "Rollouts", "SamplingParams", "make_generator"]
