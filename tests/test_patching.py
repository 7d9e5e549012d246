"""swapped() and patch(): the instance's own attribute comes back; a class method leaves no instance attribute."""

from __future__ import annotations

import pytest

from lightning_accel.patching import patch, remove_all, swapped


class Thing:
    def step(self) -> str:
        return "class"


def test_class_method_shows_through_again() -> None:
    thing = Thing()
    with swapped(thing, "step", lambda: "patched"):
        assert thing.step() == "patched"
    assert thing.step() == "class" and "step" not in vars(thing)


def test_instance_attribute_is_restored_even_after_an_error() -> None:
    thing = Thing()
    own = lambda: "own"  # noqa: E731  # what an LR scheduler's wrapper looks like: an instance attribute
    thing.step = own  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"), swapped(thing, "step", lambda: "patched"):
        raise RuntimeError("boom")
    assert vars(thing)["step"] is own


def test_patch_handles_remove_in_reverse_order_and_twice_is_harmless() -> None:
    thing = Thing()
    own = lambda: "own"  # noqa: E731
    thing.step = own  # type: ignore[method-assign]
    outer = patch(thing, "step", lambda: "outer")
    inner = patch(thing, "step", lambda: "inner")
    assert thing.step() == "inner"
    inner.remove()
    assert thing.step() == "outer"
    outer.remove()
    outer.remove()
    assert vars(thing)["step"] is own


def test_patch_of_a_class_method_leaves_no_instance_attribute() -> None:
    thing = Thing()
    handle = patch(thing, "step", lambda: "patched")
    assert thing.step() == "patched"
    handle.remove()
    assert thing.step() == "class" and "step" not in vars(thing)


def test_remove_all_unwinds_the_last_patch_first_and_empties_the_list() -> None:
    thing = Thing()
    own = lambda: "own"  # noqa: E731
    thing.step = own  # type: ignore[method-assign]
    patches = [patch(thing, "step", lambda: "outer"), patch(thing, "step", lambda: "inner")]
    remove_all(patches)
    assert vars(thing)["step"] is own and patches == []  # in setting order, "outer" would come back
