"""The blocking client mirrors the async one exactly (no engine needed)."""

from __future__ import annotations

import inspect
import pickle
import re

from trainer_client import BlockingInferenceClient, InferenceClient


def _async_methods() -> dict[str, object]:
    return {
        name: method
        # getmembers: the async client's methods live in its parts (mixins).
        for name, method in inspect.getmembers(InferenceClient)
        if not name.startswith("_")
        and (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method))
    }


def _blocking_return(async_method: object) -> str:
    """What the blocking twin returns: the same type, an iterator for an async stream."""
    annotation = inspect.signature(async_method).return_annotation  # type: ignore[arg-type]
    if inspect.isasyncgenfunction(async_method):
        (item,) = re.fullmatch(
            r"Async(?:Generator|Iterator)\[(.+?)(?:, None)?\]", annotation
        ).groups()  # type: ignore[union-attr]
        return f"Iterator[{item}]"
    return str(annotation)


def test_every_async_method_has_a_blocking_twin_with_the_same_signature() -> None:
    methods = _async_methods()
    assert {"generate", "pause", "update_weights", "stream", "load_lora", "close"} <= set(methods)
    for name, async_method in methods.items():
        blocking_method = getattr(BlockingInferenceClient, name, None)
        assert blocking_method is not None, f"BlockingInferenceClient has no {name}"
        assert not inspect.iscoroutinefunction(blocking_method), name
        async_signature = inspect.signature(async_method)  # type: ignore[arg-type]
        blocking_signature = inspect.signature(blocking_method)
        assert list(blocking_signature.parameters.values()) == list(
            async_signature.parameters.values()
        ), name
        assert blocking_signature.return_annotation == _blocking_return(async_method), name


def test_the_blocking_client_has_no_public_method_the_async_one_lacks() -> None:
    extras = {
        name
        for name, member in vars(BlockingInferenceClient).items()
        if not name.startswith("_") and inspect.isfunction(member)
    } - set(_async_methods())
    assert extras == set()


def test_both_clients_pickle_as_their_config_only() -> None:
    for client_type in (InferenceClient, BlockingInferenceClient):
        client = client_type("127.0.0.1:1", ["127.0.0.1:2"], token="t")
        restored = pickle.loads(pickle.dumps(client))
        assert restored.config == client.config
        assert len(pickle.dumps(client)) < 1000
