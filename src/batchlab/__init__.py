"""batchlab: learn how LLM servers schedule work by building one.

Importing batchlab first makes MLX use an optimized BLAS on Linux (see ``_blas``).
"""

from . import _blas  # noqa: F401  (first: before anything imports mlx)
from .engine import Engine, make_engine
from .loop import EngineLoop
from .generate import Generation, generate
from .model import LoadedModel, ModelInfo, load_model
from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["Engine", "EngineLoop", "make_engine", "Generation", "IncrementalDetokenizer", "LoadedModel", "ModelInfo", "SamplingParams",
           "Tokenizer", "generate", "load_model"]
__version__ = "0.1.0"
