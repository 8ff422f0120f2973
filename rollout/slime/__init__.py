"""slime integration, plugin mode: `--rollout-function-path rollout.slime.generate_rollout`
(and optionally `--custom-generate-function-path rollout.slime.generate`). See `adapter`."""
from rollout.slime.adapter import generate, generate_rollout, reset, set_backend, set_tokenizer
from rollout.slime.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "Sample", "generate",
           "generate_rollout", "reset", "set_backend", "set_tokenizer"]
