from mpitrain.cli import main

main(prog_name="mpitrain")
