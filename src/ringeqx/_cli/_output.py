"""What the commands print: a line, a numbered step, a size in MiB."""


def say(message: str) -> None:
    print(message, flush=True)


def step(index: int, total: int, message: str) -> None:
    say(f"[{index}/{total}] {message}")


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"
