"""The training job's parameters are declared once (components/train/job_parameters.py)."""

from __future__ import annotations

import argparse
import inspect

import pytest

from components.train.component import train_model
from components.train.job_parameters import (
    JOB_PARAMETERS,
    add_render_flags,
    job_keywords,
    render_keywords,
    with_job_docs,
    with_job_parameters,
)
from components.train.job_scale import AUTO, AUTO_COUNT
from components.train.jobs import JobSettings


def test_the_train_steps_literal_signature_is_the_tables():
    """KFP ships the step's source to the pod, so its signature stays literal: it must not drift."""
    signature = inspect.signature(train_model).parameters
    for p in JOB_PARAMETERS:
        assert p.name in signature, f"train_model lacks the job parameter {p.name}"
        assert signature[p.name].annotation in (p.kind, p.kind.__name__), p.name
        assert signature[p.name].default == p.default, p.name
        assert f"        {p.name}: {p.help}" in (train_model.__doc__ or ""), p.name


def test_every_keyword_is_one_train_with_job_takes():
    fields = {f for f in JobSettings.__dataclass_fields__}
    watch = {"namespace", "timeout_s", "pending_timeout_s"}
    for p in JOB_PARAMETERS:
        assert p.keyword in fields | watch, p.keyword
        assert not p.render_flag or p.keyword in fields, f"{p.flag} sets no manifest field"


def test_unset_has_one_spelling_inside():
    values = {p.name: p.default for p in JOB_PARAMETERS}
    keywords = job_keywords(values)
    for p in JOB_PARAMETERS:
        expected = None if p.default in (AUTO, AUTO_COUNT) else p.default
        assert keywords[p.keyword] == expected, p.name
    given = job_keywords({**values, "job_shm_size": "64Gi", "job_max_restarts": 0, "job_cpu_per_node": ""})
    assert (given["shm_size"], given["max_restarts"], given["cpu_per_node"]) == ("64Gi", 0, "")
    settings = JobSettings(
        name="j", namespace="n", image="i", trainer_args=[], gpus_per_node=8, shm_size=None
    )
    assert settings.resolved().shm_size == "320Gi" and settings.resolved().cpu_per_node == ""


def test_render_job_gets_a_flag_per_manifest_setting_with_the_pipelines_default():
    parser = argparse.ArgumentParser()
    add_render_flags(parser)
    args = parser.parse_args(["--gpus-per-node=8", "--max-restarts=2", "--shm-size=auto"])
    keywords = render_keywords(args)
    assert keywords["gpus_per_node"] == 8 and keywords["max_restarts"] == 2 and keywords["shm_size"] is None
    assert keywords["instance_type"] == "p5.48xlarge" and keywords["backoff_limit"] is None
    assert set(keywords) == {p.keyword for p in JOB_PARAMETERS if p.render_flag}
    assert "timeout_s" not in keywords and "namespace" not in keywords
    with pytest.raises(SystemExit):
        parser.parse_args(["--nnodes=two"])


def test_the_pipeline_gets_each_parameter_typed_with_its_default_and_description():
    seen = {}

    def pipeline(source: str = "s3://b/", **job):
        """Train.

        Args:
            source: where the text is.
        """
        seen.update(source=source, **job)

    compiled = with_job_parameters(pipeline)
    parameters = inspect.signature(compiled).parameters
    assert list(parameters) == ["source", *(p.name for p in JOB_PARAMETERS)]
    assert all(
        parameters[p.name].default == p.default and parameters[p.name].annotation is p.kind
        for p in JOB_PARAMETERS
    )
    compiled("s3://x/", *range(len(JOB_PARAMETERS)))  # KFP passes every value, in signature order
    assert seen["source"] == "s3://x/" and [seen[p.name] for p in JOB_PARAMETERS] == list(
        range(len(JOB_PARAMETERS))
    )
    doc = compiled.__doc__ or ""
    assert "            source: where the text is.\n            nnodes: Nodes" in doc
    assert doc.rstrip().endswith(JOB_PARAMETERS[-1].help)


def test_job_lines_go_at_the_end_of_the_args_section_before_the_text_after_it():
    doc = "Do it.\n\n    Args:\n        a: the a.\n\n    More text.\n    "
    merged = with_job_docs(doc)
    assert merged.startswith("Do it.\n\n    Args:\n        a: the a.\n        nnodes: ")
    assert merged.endswith("\n\n    More text.\n    ")
