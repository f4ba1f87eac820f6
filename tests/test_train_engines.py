"""The trainer engines' registry (hpcrl.compute.train.engine): trainer.engine's values name the engine
classes, a checkpoint names the engine that wrote it, and a resume with the other engine stops with
one line naming both. The engines themselves are exercised in test_deepspeed_engine.py and the
FSDP2 tests; here only what picks and checks them."""

from __future__ import annotations

import typing

import pytest

from hpcrl.compute.train.checkpoint import CheckpointError
from hpcrl.compute.train.engine import TRAIN_ENGINES, TrainEngine, engine_class, engine_that_wrote
from hpcrl.job import rundir
from hpcrl.job.recipe import TrainerConfig


def test_every_trainer_engine_a_recipe_accepts_is_registered_and_nothing_else():
    annotation = typing.get_type_hints(TrainerConfig)["engine"]
    accepted = set(typing.get_args(annotation))
    assert accepted == set(TRAIN_ENGINES)
    for name in TRAIN_ENGINES:
        engine = engine_class(name)
        assert issubclass(engine, TrainEngine) and engine.name == name


def test_an_unknown_engine_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"trainer.engine 'megatron': one of fsdp2, deepspeed"):
        engine_class("megatron")


def _checkpoint(tmp_path, state: str):
    path = tmp_path / "step-3"
    path.mkdir()
    if state == rundir.DCP_INDEX:
        (path / state).write_bytes(b"")
    else:
        (path / state).mkdir()
    return path


@pytest.mark.parametrize("state, writer", [(rundir.DCP_INDEX, "fsdp2"), (rundir.DEEPSPEED_STATE_DIR, "deepspeed")])
def test_a_checkpoint_names_the_engine_that_wrote_it(tmp_path, state, writer):
    path = _checkpoint(tmp_path, state)
    assert engine_that_wrote(path) is engine_class(writer)
    engine_class(writer).ensure_wrote(path)         # the same engine resumes it
    other = next(name for name in TRAIN_ENGINES if name != writer)
    with pytest.raises(CheckpointError, match=rf"^{path} was written by the {writer} engine; this run's "
                                              rf"trainer.engine is {other}: resume with the engine that wrote it$"):
        engine_class(other).ensure_wrote(path)


def test_a_directory_no_engine_wrote_says_so(tmp_path):
    with pytest.raises(ValueError, match="no trainer engine's checkpoint files"):
        engine_that_wrote(tmp_path)
