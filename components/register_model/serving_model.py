"""The MLflow pyfunc that serves a registered model: prompts in, generated text out.

Logged as "models from code": MLflow runs this file when loading the model, so nothing is
pickled. Its artifacts are `weights` (the consolidated state dict as safetensors), `config`
(the ModelConfig as JSON) and `tokenizer` (a description of the byte tokenizer); the
`trainer` package travels with it as code.
"""

from __future__ import annotations

import json

import mlflow
from mlflow.pyfunc import PythonModel, PythonModelContext


class ByteLMPyfunc(PythonModel):
    def load_context(self, context: PythonModelContext) -> None:
        import torch
        from safetensors.torch import load_file

        from trainer.config import ModelConfig
        from trainer.models import model_spec

        with open(context.artifacts["config"]) as handle:
            config = ModelConfig(**json.load(handle))
        self.model = model_spec(config.kind).build(config, torch.device("cpu"))
        self.model.load_state_dict(load_file(context.artifacts["weights"]))
        self.model.eval()

    # No type hints on predict: MLflow would try to derive a schema from them; the logged
    # signature (prompt column in, text out, generation params) is the contract.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        from trainer.models.byte_lm import ByteLM, generate

        assert isinstance(self.model, ByteLM), type(self.model)

        params = params or {}
        prompts = list(model_input["prompt"]) if hasattr(model_input, "columns") else list(model_input)
        return [
            generate(
                self.model,
                str(prompt).encode(),
                max_new_tokens=int(params.get("max_new_tokens", 64)),
                temperature=float(params.get("temperature", 0.0)),
            ).decode("utf-8", errors="replace")
            for prompt in prompts
        ]


mlflow.models.set_model(ByteLMPyfunc())
