"""The pure parts of `make faults` (serve/ops/faults.py): classifying requests around a
signal, RSS growth, the soak's mark, pacing, the CLI. The cases themselves need a real
service and run in `make faults`, not in `make test`."""
from __future__ import annotations

import json

import pytest

from serve.ops.faults import CASES, classify_signal, main, rss_growth, soak_mark_s
from serve.ops.loadgen import Answer, pacing_schedule

SHUT = json.dumps({"code": 503, "type": "ShuttingDown", "message": "bye"})


def answer(t0: float, status: int, error: str | None = None, detail: str = "") -> Answer:
    return Answer(t=t0 + 0.01, status=status, version=None, ok=status == 200, t0=t0,
                  error=error, detail=detail)


def test_requests_before_the_signal_must_be_answered() -> None:
    found = classify_signal([answer(1, 200), answer(2, 0, "ReadError", "reset"),
                             answer(3, 200)], signal_t=2.5)
    assert (found["before"], found["before_failed"], found["after_unclean"]) == (2, 1, 0)
    assert found["bad"] == ["before: ReadError reset"]


def test_after_the_signal_only_clean_refusals() -> None:
    outcomes = [answer(5, 200), answer(5, 503, detail=SHUT), answer(6, 0, "ConnectError"),
                answer(6, 503, detail="<html>busy</html>"), answer(7, 0, "ReadError"),
                answer(7, 0, "ReadTimeout")]
    found = classify_signal(outcomes, signal_t=4)
    assert found["before"] == 0 and found["after"] == 6
    assert found["after_unclean"] == 3  # a non-JSON 503, a reset, a timeout
    assert found["after_by_outcome"] == {"200": 1, "503": 2, "ConnectError": 1,
                                         "ReadError": 1, "ReadTimeout": 1}


def test_rss_growth_from_the_mark_to_the_end() -> None:
    mib = 2**20
    series = [(0, 50 * mib), (60, 100 * mib), (120, 100 * mib), (300, 104 * mib)]
    assert rss_growth(series, 120) == {"mark_mib": 100.0, "end_mib": 104.0, "growth_pct": 4.0}
    with pytest.raises(ValueError, match="need >= 2 RSS samples"):
        rss_growth(series, 200)


@pytest.mark.parametrize("soak,mark", [(600, 120), (1200, 120), (120, 24), (50, 10)])
def test_soak_mark(soak: float, mark: float) -> None:
    assert soak_mark_s(soak) == pytest.approx(mark)


def test_pacing_is_even_and_validated() -> None:
    assert pacing_schedule(4, 1) == [0, 0.25, 0.5, 0.75]
    assert pacing_schedule(10, 0) == []
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        pacing_schedule(0, 1)


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(c in out for c in CASES)
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        main(["--cases", "nope"])
    with pytest.raises(SystemExit, match="must be >= 10"):
        main(["--cases", "soak", "--soak-s", "3"])


def test_raw_burst_reads_every_answer_from_one_thread() -> None:
    """raw_burst (the burst case's load) against a stdlib server that queues 3 and
    answers the rest 503 at once: every request gets its status, with its latency."""
    import threading
    import urllib.parse
    from http.server import BaseHTTPRequestHandler

    from serve.ops.faults import raw_burst
    from tests.fakes.http_peer import local_http_server

    admitted = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                ok = len(admitted) < 3 and len(body) == 100_000
                if ok:
                    admitted.append(1)
            out = b'{"ok": true}' if ok else b'{"code": 503}'
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    with local_http_server(Handler) as url:
        results = raw_burst("127.0.0.1", urllib.parse.urlsplit(url).port, "/p",
                            b"x" * 100_000, 20, "application/octet-stream", timeout_s=30)
    assert sorted(s for s, _ in results if isinstance(s, int)) == [200] * 3 + [503] * 17
    assert all(0 < d < 30 for _, d in results)
