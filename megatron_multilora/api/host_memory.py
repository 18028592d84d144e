"""How much host memory the service may still take, and so how many training clients it
holds at once: the clients beyond the device slots keep their adapters and optimizer state
in host memory (pages) until their next call."""

from __future__ import annotations

from pathlib import Path


def available_host_bytes(root: Path = Path("/")) -> int | None:
    """What this machine can still give: ``MemAvailable``, or less where a memory cgroup this
    process is in (a container's or a systemd slice's limit; cgroup v1 or v2) allows less,
    its reclaimable page cache counted as free. None where neither can be read."""
    found = [room for room in (_mem_available(root), *_cgroup_rooms(root)) if room is not None]
    return max(0, min(found)) if found else None


def held_clients(
    wanted: int, slots: int, page_bytes: int, budget_mb: float | None, available: int | None
) -> tuple[int, str | None]:
    """The training clients held at once: ``wanted`` (api.max_training_clients), or fewer
    where the pages of those beyond the ``slots`` (``page_bytes`` each, all of this host's
    ranks together) would not fit ``budget_mb`` (api.paged_adapters_mb; None: half of
    ``available``). The table keeps a page's buffers for reuse once it is paged back in, one
    per slot, so the slots' worth of pages counts too. With it, why it is fewer, or None."""
    if wanted <= slots or page_bytes <= 0:
        return wanted, None
    if budget_mb is None:
        if available is None:  # nothing to measure by: the count alone bounds them
            return wanted, None
        budget = available // 2
        setting = (
            f"api.paged_adapters_mb (null: half the {available / 2**20:,.0f} MiB available, "
            f"{budget / 2**20:,.0f} MiB)"
        )
    else:
        budget, setting = int(budget_mb * 2**20), f"api.paged_adapters_mb={budget_mb:g}"
    fit = max(0, budget // page_bytes - slots)
    if slots + fit >= wanted:
        return wanted, None
    page = page_bytes / 2**20
    return slots + fit, (
        f"api.max_training_clients={wanted} would page {wanted - slots} clients to host "
        f"memory at {page:,.1f} MiB each on this host ({wanted * page:,.0f} MiB with the "
        f"{slots} slots' reused buffers); {setting} fits {fit} pages beside "
        f"those, so the service holds {slots + fit} training clients at once. For more: a "
        "larger api.paged_adapters_mb, a lower lora.max_rank or fewer lora.targets"
    )


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mem_available(root: Path) -> int | None:
    for line in _text(root / "proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


# cgroup version -> (its memory hierarchy's mount, limit, usage, reclaimable key of memory.stat)
_CGROUP_FILES = {
    2: ("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
    1: (
        "sys/fs/cgroup/memory",
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "total_inactive_file",
    ),
}


def _cgroup_rooms(root: Path) -> list[int | None]:
    """Limit less usage of each memory cgroup from this process's own up to the hierarchy's
    root (a limit may sit on any of them)."""
    rooms = []
    for line in _text(root / "proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else 0
        if not version:
            continue
        mount, limit, usage, reclaimable = _CGROUP_FILES[version]
        base = root / mount
        folder = base / path.lstrip("/")
        if not folder.is_dir():  # in a cgroup namespace the mount is this process's own
            folder = base
        while True:
            rooms.append(_room(folder, limit, usage, reclaimable))
            if folder == base:
                break
            folder = folder.parent
    return rooms


def _room(folder: Path, limit: str, usage: str, reclaimable: str) -> int | None:
    limit_text, usage_text = _text(folder / limit).strip(), _text(folder / usage).strip()
    if not limit_text or not usage_text or limit_text == "max":
        return None
    stat = dict(ln.split(" ", 1) for ln in _text(folder / "memory.stat").splitlines() if " " in ln)
    try:
        return int(limit_text) - int(usage_text) + int(stat.get(reclaimable, 0))
    except ValueError:
        return None
