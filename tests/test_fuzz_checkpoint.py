"""Hostile MINI checkpoints (`fuzz.checkpoint`'s generators, which the fuzz
campaign draws from): `mkc check --model DIR` on each gives located diagnostics with a hint,
never another exception."""
import random

import pytest

from mkc.diagnostics import MkcError

from fuzz import checkpoint as fk

SEED = 3


@pytest.mark.parametrize("name", sorted(fk.GENERATORS))
def test_each_hostile_checkpoint_is_a_diagnostic(tmp_path, name):
    rng = random.Random(f"{SEED}:{name}")
    described = fk.GENERATORS[name](rng, tmp_path / "ckpt")
    with pytest.raises(MkcError) as e:
        fk.check(described, tmp_path / "ckpt")
    for d in e.value.diagnostics:
        assert d.span.file.endswith(".sched") and d.span.line > 1 and d.hint, (described, d)
        d.render(fk.spec_text(described))


def test_generators_are_pure_functions_of_the_rng(tmp_path):
    for name, generate in fk.GENERATORS.items():
        if name in ("nan_e8m0_scale",):      # K3 MINI's 114 MB twice: its draws are the same code
            continue
        a = generate(random.Random(name), tmp_path / name / "a")
        b = generate(random.Random(name), tmp_path / name / "b")
        assert a.replace("/a", "/b") == b, name
        for f in sorted((tmp_path / name / "a").iterdir()):
            g = tmp_path / name / "b" / f.name
            if not f.is_symlink() and f.stat().st_size < 1 << 24:
                assert f.read_bytes() == g.read_bytes(), (name, f.name)
