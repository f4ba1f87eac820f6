"""One module per `hpcrl` subcommand, each with `main(args) -> int` (args: cli.py's parsed arguments).

cli.py imports only the module of the command given, so each command pays only for its own
imports: `hpcrl status` never loads jinja2, YAML or the recipe, `hpcrl --help` none of these.
"""
