"""What operators watch, on a real fleet (`up`'s LocalFleet: two engine servers and a router
as processes): every server exports vLLM's own metrics and its own on a port of its own, a
real Prometheus (Debian's package) scrapes them and sees generation and weight updates,
every panel of the dashboard in docs/ asks for a metric the stack exports, and the router's
live fleet page, in a real headless browser (Debian's chromium, driven by Playwright), shows
both servers, a new weight version and a killed server going and coming back."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from servers.fleet.local import LocalFleet
from skyrl_grpc.process_group import free_port
from tests.helpers.waits import ENGINE_START_SECONDS, wait_until
from tests.helpers.weights import perturbed
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "dashboards" / "skyrl-grpc-fleet.json"
# The metrics vLLM's own server exports that vLLM dashboards and SkyRL's logging read.
VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def scrape(host_port: str) -> dict[str, float]:
    """Every sample of a /metrics page: its name with labels -> value."""
    samples = {}
    for line in page(host_port).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def page(host_port: str) -> str:
    return str(urllib.request.urlopen(f"http://{host_port}/metrics", timeout=10).read().decode())


def declared(host_port: str) -> set[str]:
    """Every metric a /metrics page declares (``# TYPE``), as queries name its series: a
    counter's ``_total``, a histogram's ``_bucket``, ``_count`` and ``_sum`` (a labelled metric
    with no sample yet has no series to show, but is exported all the same)."""
    names = set()
    for line in page(host_port).splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter":
                names.add(name if name.endswith("_total") else f"{name}_total")
            elif kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
            else:
                names.add(name)
    return names


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    found = 0.0
    for key, value in samples.items():
        base = key.split("{", 1)[0]
        if base == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            found += value
    return found


class Stack:
    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        host = fleet.addresses.router.rpartition(":")[0]
        self.servers = [f"{host}:{port}" for port in fleet.server_metrics_ports]
        self.router = f"{host}:{fleet.metrics_port}"
        self.prometheus = ""

    def query(self, promql: str) -> float:
        url = f"http://{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
        results = answer["data"]["result"]
        return float(results[0]["value"][1]) if results else float("nan")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/setup.sh installs Debian's package"
    directory = tmp_path_factory.mktemp("prometheus")
    router_args = ["--metrics-port", "0", "--http-port", "0"]
    with LocalFleet(
        2, router_args=router_args, server_metrics=True, start_timeout=ENGINE_START_SECONDS
    ) as fleet:
        wait_until(lambda: all(fleet.server_metrics_ports), 30, "the servers' metrics ports")
        stack = Stack(fleet)
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n"
            f"  - job_name: skyrl-servers\n    static_configs:\n      - targets: {stack.servers}\n"
            f"  - job_name: skyrl-router\n    static_configs:\n      - targets: ['{stack.router}']\n"
        )
        port = free_port("127.0.0.1")
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=(directory / "prometheus.log").open("w"),
        )  # fmt: skip
        stack.prometheus = f"127.0.0.1:{port}"
        try:
            wait_until(lambda: ready(stack.prometheus), 60, "Prometheus to be ready")
            yield stack
        finally:
            process.terminate()
            process.wait(30)


def ready(address: str) -> bool:
    try:
        return bool(urllib.request.urlopen(f"http://{address}/-/ready", timeout=2).status == 200)
    except OSError:
        return False


async def test_every_server_exports_vllms_metrics_and_its_own(
    stack: Stack, tiny_model_dir: Path
) -> None:
    """Each server's /metrics has vLLM's own metrics under vLLM's names, counting what it
    served; its weight version; each weight update phase; its gRPC calls by method and code."""
    client = InferenceClient(stack.fleet.addresses.router, list(stack.fleet.addresses.servers))
    await client.generate_batch([[1, 2, 3]] * 4, {"max_tokens": 4, "ignore_eos": True})
    version = max((await client.weight_versions()).values()) + 1
    weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=71)
    await client.update_weights(weights.items(), version)
    await client.close()
    served = data_calls = 0.0
    for server in stack.servers:
        samples = await asyncio.to_thread(scrape, server)
        missing = [m for m in VLLM_METRICS if not any(k.split("{")[0] == m for k in samples)]
        assert not missing, f"{server} lacks {missing}"
        served += total(samples, "vllm:time_to_first_token_seconds_count")
        assert total(samples, "skyrl_server_weight_version") == version
        assert total(samples, "skyrl_weight_update_phase_seconds_count", phase="commit") >= 1
        assert total(samples, "skyrl_weight_update_phase_seconds_count", phase="transfer") >= 1
        assert total(samples, "skyrl_weight_update_bytes_total") > 0
        assert total(samples, "grpc_server_handled_total", grpc_method="FinishWeightUpdate",
                     grpc_code="OK") >= 1  # fmt: skip
        data_calls += total(
            samples,
            "grpc_server_handling_seconds_count",
            grpc_service="skyrl.inference.v1.DataPlane",
        )
    assert served >= 4  # the batch's four requests, on one server or both
    assert data_calls >= 1


async def test_a_real_prometheus_sees_generation_and_the_weight_version_change(
    stack: Stack, tiny_model_dir: Path
) -> None:
    """Prometheus scraping the fleet: ``vllm:time_to_first_token_seconds_count`` rises while
    the fleet generates, and ``skyrl_server_weight_version`` follows an update."""

    def query(promql: str) -> float:
        return stack.query(promql)

    ttft = "sum(vllm:time_to_first_token_seconds_count)"
    scraped = "count(up{job='skyrl-servers'} == 1)"
    await asyncio.to_thread(
        wait_until, lambda: query(scraped) == 2, 30, "Prometheus to scrape both servers"
    )
    before = await asyncio.to_thread(query, ttft)
    before = 0.0 if math.isnan(before) else before
    client = InferenceClient(stack.fleet.addresses.router, list(stack.fleet.addresses.servers))
    await client.generate_batch([[1, 4, 5]] * 8, {"max_tokens": 4, "ignore_eos": True})
    await asyncio.to_thread(
        wait_until, lambda: query(ttft) >= before + 8, 30, "Prometheus to see the requests"
    )
    version = max((await client.weight_versions()).values()) + 1
    weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=72)
    await client.update_weights(weights.items(), version)
    await client.close()
    await asyncio.to_thread(
        wait_until,
        lambda: query("min(skyrl_server_weight_version)") == version,
        30,
        f"Prometheus to see version {version} on every server",
    )


async def test_the_router_exports_each_workers_tokens_ttft_placements_and_http_requests(
    stack: Stack,
) -> None:
    """A streamed completion through the HTTP edge shows on the router's page: the worker it
    ran on got a placement, its first tokens (TTFT) and every token, and the edge one 200."""
    before = await asyncio.to_thread(scrape, stack.router)
    host = stack.fleet.addresses.router.rpartition(":")[0]
    body = json.dumps(
        {"model": "", "prompt": [1, 4, 5], "max_tokens": 12, "stream": True, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"http://{host}:{stack.fleet.http_port}/v1/completions",
        body,
        {"Content-Type": "application/json", "X-Session-ID": "metrics-session"},
    )
    answer = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=60).read())
    assert b"[DONE]" in answer
    # The edge counts a request once its answer has ended, which the client may see first
    # (its last bytes are written before the edge's handler returns): wait for that count.
    pages: list[dict[str, float]] = []
    http_200 = {"route": "/v1/completions", "status": "200"}

    def counted() -> bool:  # its count and its duration, recorded one after the other
        pages.append(scrape(stack.router))
        duration = "skyrl_router_http_request_duration_seconds_count"
        return total(pages[-1], "skyrl_router_http_requests_total", **http_200) > total(
            before, "skyrl_router_http_requests_total", **http_200
        ) and total(pages[-1], duration, route=http_200["route"]) > total(
            before, duration, route=http_200["route"]
        )

    await asyncio.to_thread(wait_until, counted, 30, "the edge to count the request")
    after = pages[-1]

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("skyrl_router_http_requests_total", **http_200) == 1
    assert grew("skyrl_router_http_request_duration_seconds_count", route="/v1/completions") == 1
    workers = [
        worker
        for worker in stack.fleet.addresses.servers
        if grew("skyrl_router_ttft_seconds_count", worker=worker) > 0
    ]
    assert len(workers) == 1, "the stream's first tokens are counted once, on its worker"
    assert grew("skyrl_router_tokens_total", worker=workers[0], token_type="output") == 12
    assert grew("skyrl_router_inter_token_latency_seconds_count", worker=workers[0]) >= 1
    assert grew("skyrl_router_policy_decisions_total", worker=workers[0]) >= 1
    assert grew("skyrl_router_processed_requests_total", worker=workers[0]) >= 1


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression reads (identifiers followed by a selector, a
    range or the end, not functions or labels)."""
    without_labels = re.sub(r"\{[^}]*\}", "", expression)
    without_by = re.sub(r"\b(by|without)\s*\([^)]*\)", "", without_labels)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_by))
    functions = {"sum", "rate", "histogram_quantile", "changes", "max", "min", "avg", "le"}
    return {n for n in names if n not in functions and ("_" in n or ":" in n)}


async def test_every_dashboard_panel_asks_for_a_metric_the_stack_exports(stack: Stack) -> None:
    exported: set[str] = set()
    for target in [*stack.servers, stack.router]:
        exported |= await asyncio.to_thread(declared, target)
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in metric_names(target["expr"])
    }
    assert asked, "the dashboard reads no metric"
    missing = sorted(asked - exported)
    assert not missing, f"panels read metrics nothing exports: {missing}"


async def test_the_fleet_page_shows_the_servers_an_update_and_a_server_lost_and_back(
    stack: Stack, tiny_model_dir: Path
) -> None:
    from playwright.async_api import async_playwright

    browser_binary = shutil.which("chromium")
    assert browser_binary, "chromium is not installed: scripts/setup.sh installs Debian's package"
    fleet = stack.fleet
    host = fleet.addresses.router.rpartition(":")[0]
    servers = list(fleet.addresses.servers)

    def row(table: str, server: str, extra: str = "") -> str:
        return f'#{table} tr[data-server="{server}"]{extra}'

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=browser_binary)
        try:
            page = await browser.new_page()
            await page.goto(f"http://{host}:{fleet.http_port}/fleet")
            for index, server in enumerate(servers):  # both, healthy, each with its own seed
                await page.wait_for_selector(row("servers", server, " td.state.healthy"))
                await page.wait_for_function(
                    "([selector, seed]) => document.querySelector(selector)?.textContent === seed",
                    arg=[row("servers", server, " td.seed"), str(index)],
                )

            client = InferenceClient(fleet.addresses.router, servers)
            version = max((await client.weight_versions()).values()) + 1
            weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=73)
            await client.update_weights(weights.items(), version)
            await client.close()
            for server in servers:  # the new version, and the update with its phases
                await page.wait_for_function(
                    "([selector, version]) => document.querySelector(selector)?.textContent"
                    " === version",
                    arg=[row("servers", server, " td.version"), str(version)],
                )
                update = row("updates", server, f'[data-version="{version}"]')
                assert await page.text_content(f"{update} td.outcome") == "committed"
                phases = await page.text_content(f"{update} td.phases") or ""
                assert "transfer" in phases and "commit" in phases, phases

            lost = servers[1]
            await asyncio.to_thread(fleet.kill_server, 1)
            await page.wait_for_selector(
                row("servers", lost, " td.state:not(.healthy)"), timeout=60_000
            )
            await page.wait_for_selector(f'#events tr[data-kind="lost"][data-server="{lost}"]')
            await asyncio.to_thread(fleet.restart_server, 1, ENGINE_START_SECONDS)
            await page.wait_for_selector(row("servers", lost, " td.state.healthy"), timeout=60_000)
            await page.wait_for_selector(f'#events tr[data-kind="back"][data-server="{lost}"]')
            # Caught up from its peer: the page shows it on the fleet's version again.
            await page.wait_for_function(
                "([selector, version]) => document.querySelector(selector)?.textContent"
                " === version",
                arg=[row("servers", lost, " td.version"), str(version)],
            )
        finally:
            await browser.close()
