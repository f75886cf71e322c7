"""The printed rows and the closing markdown table of the matmul benchmark: per timed row its
time, TB/s of weight bytes, share of the copy bandwidth and speedup over the bf16 peer; per
(shape, M) the peer, INT4 and INT8 in the model's layout and the Mosaic GPU peer."""
from __future__ import annotations


def report(row: dict, calib: dict) -> None:
    """Prints one row (its error, or its time, TB/s, share of copy and speedups); stores the
    share of copy in the row."""
    if "error" in row:
        print(f"{row['K']:>6}x{row['N']:<7} M={row['M']:<5} {row['impl']:<16} {row['error']}")
        return
    frac = row["TBps"] / calib["copy_TBps"] if calib else float("nan")
    row["frac_copy"] = frac
    dev = (f" | dev {row['dev_us']:7.1f} us x{row.get('dev_speedup', 1.0):5.2f}"
           if "dev_us" in row else "")
    print(f"{row['K']:>6}x{row['N']:<7} M={row['M']:<5} {row['impl']:<16} {row['us']:9.1f} us "
          f"{row['TBps']:5.2f} TB/s ({frac:4.0%} of copy) x{row.get('speedup', float('nan')):5.2f}"
          f"{dev}  {row.get('config', '') or row.get('via', '')}")


def product_us(row: dict | None) -> float | None:
    """The row's time per product: the device's (--device_times) where it has one, else the
    wall clock's; None for a missing or failed row."""
    if row is None or "error" in row:
        return None
    return row.get("dev_us", row["us"])


def summary_table(rows: list[dict], calib: dict) -> str:
    """Markdown: per shape and M the bf16 peer (with the bf16 weight's copy floor), INT4 and
    INT8 in the model's layout (`int*_nk`; the [K, N] dispatch where those did not run): time,
    TB/s of weight bytes (share of copy) and speedup over the peer, and the Mosaic GPU int8
    peer."""
    def fmt(row, peer_us):
        us = product_us(row)
        if us is None:
            return "- | - | -"
        tbps = row["TBps"] * row["us"] / us  # the same bytes over this time
        frac = f" ({tbps / calib['copy_TBps']:.0%})" if calib else ""
        return f"{us:.1f} | {tbps:.2f}{frac} | {peer_us / us:.2f}x"
    lines = ["| K x N | M | bf16 us (floor) | INT4 us | INT4 TB/s (% copy) | INT4 x bf16 | "
             "INT8 us | INT8 TB/s (% copy) | INT8 x bf16 | Mosaic int8 us (x bf16) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by_key = {(r["K"], r["N"], r["M"], r["impl"]): r for r in rows}
    for k, n, m in dict.fromkeys((r["K"], r["N"], r["M"]) for r in rows):
        peer_us = product_us(by_key.get((k, n, m, "xla_bf16")))
        if peer_us is None:
            continue
        floor = f" ({2 * k * n / calib['copy_TBps'] / 1e6:.1f})" if calib else ""
        cells = [f"{k}x{n}", str(m), f"{peer_us:.1f}{floor}"]
        for bits in (4, 8):
            row = by_key.get((k, n, m, f"int{bits}_nk")) or by_key.get((k, n, m, f"int{bits}"))
            cells.append(fmt(row, peer_us))
        mgpu_us = product_us(by_key.get((k, n, m, "mgpu_int8_peer")))
        cells.append("-" if mgpu_us is None else f"{mgpu_us:.1f} ({peer_us / mgpu_us:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    """Markdown: per shape, M and bits of a sweep, the heuristic's tiles against the fastest
    swept tiles of the Triton kernel and (on Hopper) of the Hopper kernel, over the bf16 peer."""
    lines = ["| K x N | M | bits | bf16 us | heuristic us | best us | best tiles | Hopper best us "
             "| Hopper best tiles |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    by_key = {(r["K"], r["N"], r["M"], r["impl"]): r for r in rows}
    for k, n, m, bits in dict.fromkeys((r["K"], r["N"], r["M"], r["bits"]) for r in rows
                                       if r.get("bits") in (4, 8)):
        cells = [f"{k}x{n}", str(m), str(bits)]
        for impl in ("xla_bf16", f"int{bits}_heuristic", f"int{bits}_best"):
            us = product_us(by_key.get((k, n, m, impl)))
            cells.append("-" if us is None else f"{us:.1f}")
        cells.append(by_key.get((k, n, m, f"int{bits}_best"), {}).get("config", "-"))
        hopper = by_key.get((k, n, m, f"int{bits}_wgmma_best"))
        cells += ["-", "-"] if hopper is None else [f"{product_us(hopper):.1f}", hopper["config"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
