"""Experiments behind the ``pyllamacpp`` subcommands; each returns data, the CLI prints it."""
