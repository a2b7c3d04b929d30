"""A Llama serving engine built on prefix-cache: see engine.py for the step, server.py for HTTP."""

from .config import LLAMA_1B, LLAMA_8B, MODELS, SMOLLM2_135M, ModelConfig
from .engine import EngineConfig, EngineStats, LLMEngine
from .model import LlamaModel
from .request import Request, Sample, SamplingParams, Status
from .scheduler import SchedulerConfig

__all__ = [
    "LLAMA_1B",
    "LLAMA_8B",
    "MODELS",
    "SMOLLM2_135M",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "LlamaModel",
    "ModelConfig",
    "Request",
    "Sample",
    "SamplingParams",
    "SchedulerConfig",
    "Status",
]
