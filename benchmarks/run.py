"""A benchmark run: its sections in order, the report rewritten after each."""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from pathlib import Path

import torch

import megatron_multilora as mm
from benchmarks.adapters import section_adapters
from benchmarks.api_service import section_api
from benchmarks.cuda_graphs import section_graphs
from benchmarks.jobs import section_jobs
from benchmarks.launches import section_launches
from benchmarks.layers_and_models import section_layers_models
from benchmarks.mainjob import section_mainjob
from benchmarks.memory import section_memory
from benchmarks.peers.rows import section_peers
from benchmarks.pipeline_parallel import pp_model_config, section_pp
from benchmarks.post_training import section_post
from benchmarks.report import Results, Row, hardware, load_average, markdown, versions
from benchmarks.rl_tenants import section_rl
from benchmarks.scaling import section_scaling, section_width, width_config
from benchmarks.settings import SECTIONS, Settings
from benchmarks.soak import section_soak
from benchmarks.tensor_parallel import section_tp
from benchmarks.timing import Clock
from benchmarks.workloads import model_config

RUN_SECTION = {
    "layers": lambda s, d, c, o: section_layers_models("layers", s, d, c, o),
    "models": lambda s, d, c, o: section_layers_models("models", s, d, c, o),
    "jobs": section_jobs,
    "memory": section_memory,
    "tp": section_tp,
    "pp": section_pp,
    "scaling": section_scaling,
    "width": section_width,
    "peers": section_peers,
    "post": section_post,
    "launches": section_launches,
    "graphs": section_graphs,
    "api": section_api,
    "rl": section_rl,
    "mainjob": section_mainjob,
    "adapters": section_adapters,
    "soak": section_soak,
}


def model_configs(s: Settings, sections: tuple[str, ...]) -> dict[str, dict]:
    """The whole-model configs the report lists (those of the sections run)."""
    models = {k: dataclasses.asdict(model_config(k, s)) for k in ("dense", "moe")}
    if "pp" in sections:
        models["dense (rows 7)"] = dataclasses.asdict(pp_model_config(s))
    if "width" in sections:
        models["SmolLM2-135M shape (row 9)"] = dataclasses.asdict(width_config(s))
    return models


def run_benchmark(s: Settings, out_dir: Path, sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """Run ``sections`` (all by default); a partial run writes ``<name>-only-<sections>.md`` /
    ``.json``. The report is rewritten after every section, so a section that fails (its
    error becomes a row, the next section runs) or a run cut short keeps every figure
    measured before. Returns the sections that failed."""
    device = torch.device(s.device)
    clock = Clock(device)
    mm.init_parallel(seed=0)
    hw, ver = hardware(device), versions()
    clock.say(
        f"{hw.get('gpu', hw['cpu'])}, {hw['cpu_cores']} cores, {hw['torch_threads']} "
        f"threads; " + ", ".join(f"{k} {v}" for k, v in ver.items())
    )
    clock.say(f"settings: {dataclasses.asdict(s)}; sections: {', '.join(sections)}")
    meta = {
        "device": device.type,
        "hardware": hw,
        "versions": ver,
        "settings": dataclasses.asdict(s),
        "sections": list(sections),
        "models": model_configs(s, sections),
        "load_start": load_average(),
    }
    name = ("gpu" if device.type == "cuda" else "cpu") + (
        "" if tuple(sections) == SECTIONS else "-only-" + "-".join(sections)
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Results()
    for k, section in enumerate(sections):
        try:
            RUN_SECTION[section](s, device, clock, out)
        except Exception as e:  # the next sections still run; the report says what failed
            traceback.print_exc()
            out.failed[section] = f"{type(e).__name__}: {e}"[:300]
            out.rows.append(
                Row(
                    section,
                    f"section {section}",
                    f"the {section} section",
                    "-",
                    "-",
                    "ms",
                    skipped=f"FAILED ({out.failed[section]})",
                )
            )
        meta.update(
            sections_done=list(sections[: k + 1]),
            failed=out.failed,
            load_end=load_average(),
            runtime_s=time.perf_counter() - clock.start,
        )
        text = markdown(meta, out.rows)
        (out_dir / f"{name}.md").write_text(text)
        (out_dir / f"{name}.json").write_text(
            json.dumps(
                {
                    "meta": meta,
                    "rows": [dataclasses.asdict(r) for r in out.rows],
                    "samples_s": out.samples,
                    "memory_probes": out.probes,
                    **({"peers": out.peers} if out.peers else {}),
                    **({"mainjob": out.mainjob} if out.mainjob else {}),
                    **({"soak": out.soak} if out.soak else {}),
                },
                indent=1,
            )
        )
        clock.say(
            f"section {section} {'FAILED' if section in out.failed else 'done'}: "
            f"wrote {out_dir / name}.md and .json"
        )
    mm.destroy_parallel(destroy_process_group=True)
    print(text, flush=True)
    return list(out.failed)
