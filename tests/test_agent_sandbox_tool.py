"""The agent's code tool in the reward service's sandboxes (issue 33, item 3): a live service
on loopback with a ``tool`` pipeline and a ``code`` reward pipeline, two tenants."""

from __future__ import annotations

import ast
import json
import os
import threading
import time

import httpx
import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient, RewardServiceError
from m2flow.reward_service.sandbox import isolation
from m2flow.reward_service.schemas import ServiceConfig
from m2flow.workers.agent.sandbox_tool import NO_OUTPUT, sandbox_tool

TOKENS = {"alice": "alice-token-123", "bob": "bob-token-4567"}
#: in the service's environment (so its workers'): no sandbox may see it
SECRET_ENV = ("M2FLOW_TEST_SERVICE_SECRET", "s3cret-in-the-service-env")
SANDBOX = {"wall_s": 4.0, "cpu_s": 2, "memory_bytes": 256 * 2**20}
needs_namespaces = pytest.mark.skipif(
    isolation() != "namespaces", reason="needs PID and mount namespaces (unshare as root)"
)


def _config() -> ServiceConfig:
    return ServiceConfig.model_validate(
        {
            "port": 0,
            "tenants": {n: {"token": t} for n, t in TOKENS.items()},
            "max_requests_per_tenant": 2,
            "pipelines": {
                "tools": {
                    "kind": "tool",
                    "stages": {
                        "run": {
                            "timeout_s": 10,
                            "max_workers": 3,
                            "options": {"sandbox": SANDBOX, "max_output_bytes": 1024},
                        }
                    },
                },
                "code": {
                    "kind": "code",
                    "penalty": -1.0,
                    "stages": {"execute": {"options": {"sandbox": SANDBOX}}},
                },
            },
        }
    )


@pytest.fixture(scope="module")
def service():
    os.environ[SECRET_ENV[0]] = SECRET_ENV[1]
    try:
        server = BackgroundServer(_config())
        with server:
            yield server
    finally:
        del os.environ[SECRET_ENV[0]]


@pytest.fixture(scope="module")
def alice(service):
    with RewardClient(service.url, TOKENS["alice"], retry_s=0) as c:
        yield c


def _py(service, tenant: str = "alice", timeout_s: float = 3.0):
    return sandbox_tool(service.url, TOKENS[tenant], timeout_s=timeout_s)


def test_the_python_tool_returns_what_the_code_prints(service, alice):
    tool = _py(service)
    assert tool.name == "python" and tool.sandbox is True
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    assert tool.fn(code="print(6 * 7)\nimport sys\nprint('to stderr', file=sys.stderr)") == (
        "42\nto stderr\n"
    )
    assert tool.fn(code="x = 1") == NO_OUTPUT
    res = alice.run_tool("python", {"code": "print('é' * 600)"}, timeout_s=3)
    # 1024 bytes kept (the pipeline's max_output_bytes): 512 two-byte characters
    assert res["ok"] and res["status"] == "ok" and res["truncated"] and res["error"] == ""
    assert res["output"] == "é" * 512 and res["seconds"] > 0
    assert tool.fn(code="print('ab' * 1000)").endswith("\n[output truncated]")


def test_code_that_raises_gives_the_error_text(service, alice):
    out = _py(service).fn(code="print('before')\nraise ValueError('bad input 7')\n")
    assert out.startswith("error: Traceback")
    assert "ValueError: bad input 7" in out and 'File "<tool>", line 2' in out
    assert out.endswith("output before the error:\nbefore\n")
    res = alice.run_tool("python", {"code": "def f(:\n    pass\n"})
    assert res["status"] == "error" and "SyntaxError" in res["error"]
    res = alice.run_tool("python", {"code": "import sys\nsys.exit(3)"})
    assert not res["ok"] and res["error"] == "SystemExit: 3"


def test_code_that_hangs_or_hogs_is_stopped_at_its_limits(service, alice):
    res = alice.run_tool("python", {"code": "import time\ntime.sleep(60)\n"}, timeout_s=1.5)
    assert res["status"] == "timeout" and not res["ok"]
    assert res["error"] == "timeout: stopped at its 1.5 s wall-clock limit"
    # the CPU limit follows the timeout (2 s): killed by it or by the wall clock, whichever
    # comes first on a loaded machine
    res = alice.run_tool("python", {"code": "while True:\n    pass\n"}, timeout_s=2)
    assert res["status"] in ("timeout", "killed") and not res["ok"], res
    assert "CPU-time limit of 2 s" in res["error"] or "wall-clock" in res["error"]
    out = _py(service, timeout_s=1).fn(code="while True:\n    pass\n")
    assert out.startswith("error: ") and ("limit" in out)
    res = alice.run_tool("python", {"code": "x = bytearray(4 * 1024**3)\n"})
    assert res["status"] == "error" and res["error"].endswith("MemoryError")
    res = alice.run_tool("python", {"code": "import os\nos.fork()\n"})
    assert "BlockingIOError" in res["error"]
    # the service still serves
    assert alice.run_tool("python", {"code": "print(1)"})["output"] == "1\n"


@needs_namespaces
def test_host_files_secrets_and_other_runs_are_out_of_reach(service, alice, tmp_path):
    config = tmp_path / "service.yaml"  # a config as a deployment keeps it: world-readable
    config.write_text(f"tenants: {{alice: {{token: {TOKENS['alice']}}}}}\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(config, 0o644)
    read = f"print(open({str(config)!r}).read())\n"
    res = alice.run_tool("python", {"code": read})
    assert "FileNotFoundError" in res["error"] and TOKENS["alice"] not in str(res)
    # ... as for a reward: the same read fails in the code pipeline's sandbox
    alice.register("escape", "code")
    b = alice.announce("escape", 1)
    alice.submit("escape", b, {"code": read, "tests": ["assert True"]}, id="r")
    (r,) = alice.results("escape", b, timeout_s=60)
    assert r["status"] == "failed" and "FileNotFoundError" in r["detail"]
    for path in ("/etc/shadow", "/etc/passwd", service.service.scratch.path):
        res = alice.run_tool("python", {"code": f"print(open({path!r}).read())"})
        assert res["status"] == "error" and "FileNotFoundError" in res["error"], path
    res = alice.run_tool("python", {"code": "import os\nprint(dict(os.environ))"})
    assert res["ok"] and res["output"].startswith("{'PATH': ")
    assert SECRET_ENV[1] not in res["output"] and SECRET_ENV[0] not in res["output"]
    assert ast.literal_eval(res["output"]).keys() == {"PATH", "LANG"}
    # the harness (PID 1 of the run) is another uid: its environment is not readable
    res = alice.run_tool("python", {"code": "print(open('/proc/1/environ').read())"})
    assert "PermissionError" in res["error"] and res["output"] == ""

    # alice's run keeps a file in its scratch and sleeps; bob's, meanwhile, sees none of it
    hold = (
        "import time\nopen('/scratch/alice.txt', 'w').write('alice private')\n"
        "print('written')\ntime.sleep(2)\n"
    )
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("a", alice.run_tool(
        "python", {"code": hold}, timeout_s=4)))  # fmt: skip
    t.start()
    look = (
        "import os\nprint(os.listdir('/scratch'))\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "print([os.path.join(d, f) for d, _, fs in os.walk('/') if not d.startswith(('/usr', "
        "'/proc')) for f in fs if 'alice' in f])\n"
    )
    _wait(lambda: service.service.pools["tools"][0].busy)
    time.sleep(0.5)  # its sandbox starting: bob looks while alice's run holds its file
    with RewardClient(service.url, TOKENS["bob"], retry_s=0) as bob:
        res = bob.run_tool("python", {"code": look})
    t.join(30)
    assert got["a"]["ok"] and got["a"]["output"] == "written\n"
    # an empty scratch, only its own harness (1) and child (2), no file named alice anywhere
    assert res["ok"] and res["output"] == "[]\n['1', '2']\n[]\n", res


def test_one_tenant_cannot_use_up_another_tenants_limits(service):
    sleep = {"tool": "python", "arguments": {"code": "import time\ntime.sleep(2.5)"}}
    headers = {n: {"Authorization": f"Bearer {t}"} for n, t in TOKENS.items()}
    got = []

    def call():
        r = httpx.post(f"{service.url}/v1/tools/run", json=sleep, headers=headers["alice"],
                       timeout=30)  # fmt: skip
        got.append(r.json())

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    eng = service.service
    _wait(lambda: eng.tool_live["tools"] == 2)
    # alice's two calls fill her share of requests in flight (max_requests_per_tenant: 2)
    # and hold her queued bytes; bob's are his own
    over = httpx.post(f"{service.url}/v1/tools/run", json=sleep, headers=headers["alice"])
    assert over.status_code == 429 and "Retry-After" in over.headers
    assert eng.budget.view("alice")["tenant"] > 0 and eng.budget.view("bob")["tenant"] == 0
    quick = {"tool": "python", "arguments": {"code": "print('bob ran')"}}
    r = httpx.post(f"{service.url}/v1/tools/run", json=quick, headers=headers["bob"], timeout=30)
    assert r.status_code == 200 and r.json()["output"] == "bob ran\n"
    assert eng.tool_live["tools"] == 2  # bob ran while alice's two still ran
    for t in threads:
        t.join(30)
    assert [g["ok"] for g in got] == [True, True]
    assert eng.budget.view("alice")["tenant"] == 0  # given back with the answers


def test_a_tenant_with_fewer_calls_in_flight_is_served_first():
    # one worker: alice queues three calls, then bob one; bob's runs second, not fourth
    cfg = _config().model_copy(update={"max_requests_per_tenant": 4})
    cfg.pipelines["tools"].stages["run"].max_workers = 1
    order, lock = [], threading.Lock()
    server = BackgroundServer(cfg)
    pool = server.service.pools["tools"][0]

    def call(tenant: str, seconds: float) -> None:
        code = f"import time\ntime.sleep({seconds})"
        with RewardClient(server.url, TOKENS[tenant], retry_s=0) as c:
            res = c.run_tool("python", {"code": code})
        with lock:
            order.append((tenant, res["ok"]))

    with server:
        first = threading.Thread(target=call, args=("alice", 2.0))
        first.start()
        _wait(lambda: pool.busy)  # alice's first runs ...
        more = [threading.Thread(target=call, args=("alice", 0.2)) for _ in range(2)]
        for t in more:
            t.start()
        _wait(lambda: len(pool.queue) == 2)  # ... her next two wait, then bob's arrives
        bob = threading.Thread(target=call, args=("bob", 0.2))
        bob.start()
        _wait(lambda: len(pool.queue) == 3 or not pool.busy)
        for t in [first, *more, bob]:
            t.join(60)
    assert order == [("alice", True), ("bob", True), ("alice", True), ("alice", True)], order


def test_unknown_tools_and_bad_arguments_are_refused_with_4xx(service, alice):
    cases = [
        (("nope", {"code": "1"}), 404, "unknown tool 'nope'"),
        (("python", {}), 422, "needs the argument 'code'"),
        (("python", {"code": "1", "x": 2}), 422, "unknown: ['x']"),
        (("python", {"code": 3}), 422, "'code' must be a string, got int"),
        (("python", {"code": "1"}, 30.0), 422, "over the tool pipeline's sandbox wall_s"),
        (("python", {"code": "1"}, None, "code"), 422, "runs no tools"),
        (("python", {"code": "1"}, None, "nope"), 404, "unknown pipeline"),
    ]
    for args, status, text in cases:
        with pytest.raises(RewardServiceError) as e:
            alice.run_tool(*args)
        assert e.value.status == status and text in str(e.value), (args, e.value)
    for body in ({"tool": "python", "arguments": ["print(1)"]},
                 {"tool": "python", "arguments": {"code": "1"}, "timeout_s": -1}):  # fmt: skip
        r = httpx.post(f"{service.url}/v1/tools/run", json=body,
                       headers={"Authorization": f"Bearer {TOKENS['alice']}"})  # fmt: skip
        assert r.status_code == 422, r.text
    r = httpx.post(f"{service.url}/v1/tools/run", json={"tool": "python", "arguments": {}})
    assert r.status_code == 401
    with pytest.raises(RewardServiceError, match="runs tools, not rewards"):
        alice.register("t", "tools")
    listed = alice.call("GET", "/v1/tools")[0]
    assert listed["pipelines"] == ["tools"] and listed["tools"][0]["function"]["name"] == "python"
    # the agent's tool: the service's refusal is an observation, a wrong call a TypeError
    slow = _py(service, timeout_s=30.0)
    assert slow.fn(code="print(1)").startswith("error: sandbox call failed: 422")
    with pytest.raises(TypeError):
        _py(service).fn(cod="print(1)")
    with pytest.raises(ValueError, match="unknown sandbox tool"):
        sandbox_tool(service.url, TOKENS["alice"], name="shell")


def test_a_tool_environment_runs_the_sandbox_tool_and_never_crashes(service):
    from m2flow.workers.agent.tools import ToolEnvironment

    env = ToolEnvironment([_py(service)], lambda text, item: float(text == "1024"), "hermes",
                          timeout_s=30)  # fmt: skip
    assert env.tools[0]["function"]["name"] == "python"
    env.reset({"prompt": "what is 2 ** 10?"})
    call = '<tool_call>{{"name": "python", "arguments": {{"code": {code}}}}}</tool_call>'
    turn = (
        "".join(
            call.format(code=json.dumps(c)) for c in ("print(2 ** 10)", "1 / 0", "while True: pass")
        )
        + '<tool_call>{"name": "python", "arguments": {"cod": "1"}}</tool_call>'
    )
    step = env.step({"role": "assistant", "content": turn})
    assert not step.done and [m["tool_call_id"] for m in step.messages] == [
        "call_0", "call_1", "call_2", "call_3"]  # fmt: skip
    texts = [m["content"] for m in step.messages]
    assert texts[0] == "1024\n"
    assert texts[1].startswith("error: Traceback") and "ZeroDivisionError" in texts[1]
    assert texts[2].startswith("error: ") and "limit" in texts[2]
    assert texts[3].startswith("error: bad arguments for python")
    assert step.info["tool_errors"]["bad_arguments"] == 1 and step.info["tool_calls"] == 4
    final = env.step({"role": "assistant", "content": "1024"})
    assert final.done and final.reward == 1.0


def test_an_unreachable_service_is_an_error_observation():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    out = sandbox_tool(f"http://127.0.0.1:{port}", TOKENS["alice"]).fn(code="print(1)")
    assert out.startswith("error: sandbox call failed: 503") and "unreachable" in out


def _wait(cond, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)
