"""slime integration, plugin mode: `--rollout-function-path rollout.slime.generate_rollout`
(and optionally `--custom-generate-function-path rollout.slime.generate`). See `adapter`. With slime's `train_async.py`:
`--rollout-function-path rollout.slime.generate_rollout_fully_async` (see `fully_async`)."""
from rollout.slime.adapter import generate, generate_rollout, reset, set_backend, set_tokenizer
from rollout.slime.fully_async import generate_rollout_fully_async
from rollout.slime.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "Sample", "generate",
           "generate_rollout", "generate_rollout_fully_async", "reset", "set_backend", "set_tokenizer"]
