"""`mkc perf --plot`: a PNG is written, of the expected size, and is a picture (not blank); SVG
and PDF by suffix."""
import json

from mkc.cli import main
from tests_support import SPEC


def test_plot_png_is_written_and_not_trivial(tmp_path, capsys):
    out = tmp_path / "step.png"
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "8", "--context",
                 "512", "--plot", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plot"] == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    import matplotlib.image
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (1100, 1900)
    colours = {tuple(px) for px in img[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colours) > 30          # panels, bars and text, not an empty canvas


def test_plot_svg_and_pdf_are_whole_and_reproducible(tmp_path, capsys):
    """Other formats by suffix; no date or version in the bytes, so a rerun writes the same file."""
    for suffix, magic in ((".svg", b"<?xml"), (".pdf", b"%PDF")):
        runs = []
        for i in range(2):
            out = tmp_path / f"step{i}{suffix}"
            assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "1", "--context",
                         "64", "--plot", str(out)]) == 0
            runs.append(out.read_bytes())
        assert runs[0].startswith(magic) and runs[0] == runs[1]
    capsys.readouterr()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp files left
