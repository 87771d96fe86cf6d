"""ember.core.registry: registration, duplicates, did-you-mean."""

import pytest

from ember.core.errors import UnknownNameError
from ember.core.registry import Registry


def test_register_get_and_list():
    envs = Registry("environment")

    @envs.register("CartPole-v1")
    def cartpole():
        return "cartpole"

    envs.register("Pendulum-v1", lambda: "pendulum")
    assert envs.get("CartPole-v1") is cartpole and envs.get("Pendulum-v1")() == "pendulum"
    assert envs.names() == ["CartPole-v1", "Pendulum-v1"] and list(envs) == envs.names()
    assert "CartPole-v1" in envs and len(envs) == 2


def test_duplicates_are_rejected_unless_overwritten():
    models = Registry("model")
    models.register("tiny", 1)
    with pytest.raises(ValueError, match="model 'tiny' is already registered"):
        models.register("tiny", 2)
    models.register("tiny", 3, overwrite=True)
    assert models.get("tiny") == 3
    with pytest.raises(ValueError, match="non-empty strings"):
        models.register("", 1)


def test_unknown_name_suggests_the_closest():
    envs = Registry("environment")
    for name in ("CartPole-v1", "MountainCar-v0", "Acrobot-v1"):
        envs.register(name, name)
    with pytest.raises(UnknownNameError) as info:
        envs.get("CartPol-v1")
    assert str(info.value).startswith("unknown environment 'CartPol-v1'. Did you mean 'CartPole-v1'?")
    assert "Registered: Acrobot-v1, CartPole-v1, MountainCar-v0" in str(info.value)
    assert info.value.suggestions[0] == "CartPole-v1"
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownNameError, match=r"unknown environment 'zzz'\. Registered"):
        envs.get("zzz")
