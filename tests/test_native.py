"""The extension imports and says how it was built (a linker gap only shows at import time)."""

from libra import _native


def test_native_extension_loads_with_every_core():
    info = _native.build_info()
    assert info["optimized"] is True and info["cplusplus"] >= 201703
    missing = [name for name in ("build_info", "CmlfqScheduler") if not hasattr(_native, name)]
    assert not missing
