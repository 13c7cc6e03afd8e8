"""A Hugging Face model whose tokenizer has a chat template is registered as a chat model:
`mlflow models serve` on the registered version answers an `/invocations` request carrying
`messages`, as a client of an OpenAI-style chat endpoint sends it."""

from __future__ import annotations

import pytest
import torch

from rtp_support.demo_chat import CHATML_TEMPLATE
from tests.components.serving import served_chat_reply
from tests.hf_tiny import write_tiny_model
from trainer.config import ModelConfig
from trainer.models import model_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def chat_version(tmp_path_factory):
    """A tiny tied Llama with a ChatML template, exported as the register step exports it and
    logged with `log_hf_model` into a sqlite-backed MLflow, registered as version 1."""
    import mlflow

    from components.register_model.hf_export import has_chat_template, log_hf_model

    root = tmp_path_factory.mktemp("chat-register")
    model_dir = write_tiny_model(root / "model", "llama", tie=True)
    (model_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    config = ModelConfig(kind="hf", model_dir=str(model_dir), init="pretrained", seq_len=64)
    spec = model_spec("hf")
    model = spec.build(config, torch.device("cpu"))
    exported = spec.export(model.state_dict(), config, root / "export")
    assert has_chat_template(exported)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("rtp-chat")  # this database's, not one an earlier test made active
    with mlflow.start_run():
        info = log_hf_model(exported, torch.float32)
    version = mlflow.register_model(info.model_uri, "rtp-chat")
    return uri, f"models:/rtp-chat/{version.version}", root


def test_the_served_model_answers_a_chat_request(chat_version):
    uri, model_uri, root = chat_version
    request = {"messages": [{"role": "user", "content": "What does lzma.open do?"}], "max_tokens": 8}
    answer = served_chat_reply(model_uri, uri, root, request)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert answer["usage"]["completion_tokens"] <= 8


def test_a_model_without_a_chat_template_stays_text_generation(tmp_path):
    from components.register_model.hf_export import has_chat_template

    folder = write_tiny_model(tmp_path / "plain", "llama")
    assert not has_chat_template(folder)
