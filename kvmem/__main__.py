from kvmem.cli import run

run()
