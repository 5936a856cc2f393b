"""The live adapter and the static probe resolve the same names for every pinned release."""

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES, V2_RELEASES

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("version", "variant"),
    [(v, "v1") for v in V1_RELEASES] + [(v, "v2") for v in V2_RELEASES],
)
def test_live_adapter_and_static_probe_pick_the_same_names(version, variant):
    from dynspec_patch.patcher.releases import find_pin, release_dir
    from dynspec_patch.transforms.runtime_probe import probe_directory, resolve_static
    from tests.runtime.standins import World, read_shape

    root = release_dir(find_pin(version))
    world = World(read_shape(version, variant))
    adapter = dyn._adapter_for(world.worker, variant)
    assert adapter is not None
    static = resolve_static(
        lambda rel: (root / rel).read_text() if (root / rel).is_file() else None, variant
    )
    assert adapter.names == static
    assert probe_directory(root, (variant,)).ok
