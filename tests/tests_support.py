from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
