"""The patch mechanism on throwaway classes, the plugin's version guard, and the ledger."""

import pytest

from vllm_smurfs.patches import PATCH_MODULES, _patching
from vllm_smurfs.plugin import SUPPORTED_VLLM_VERSION, check_vllm_version


class Throwaway:
    def greet(self) -> str:
        return "hello"


def test_replace_records_original_refuses_twice_and_restores():
    def loud(self) -> str:
        return _patching.original(Throwaway, "greet")(self).upper()

    assert _patching.replace_attribute(Throwaway, "greet", loud)
    try:
        assert Throwaway().greet() == "HELLO"
        assert _patching.is_patched(Throwaway, "greet")
        assert not _patching.replace_attribute(Throwaway, "greet", lambda self: "twice")
        assert Throwaway().greet() == "HELLO"
    finally:
        _patching.restore(Throwaway, "greet")
    assert Throwaway().greet() == "hello"
    assert not _patching.is_patched(Throwaway, "greet")


def test_missing_target_names_the_symbol():
    with pytest.raises(AttributeError, match="Throwaway has no attribute 'vanished'"):
        _patching.replace_attribute(Throwaway, "vanished", lambda self: None)


def test_version_guard_names_both_versions():
    check_vllm_version(SUPPORTED_VLLM_VERSION)
    check_vllm_version(SUPPORTED_VLLM_VERSION + "+cpu")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only, but vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")


def test_every_patch_module_is_in_the_ledger():
    import vllm_smurfs.patches as patches

    for module in PATCH_MODULES:
        assert module.rsplit(".", 1)[1] in patches.__doc__
