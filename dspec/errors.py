"""Errors the library raises for bad input from the user."""


class UserError(ValueError):
  """An error caused by the command line, config or data the user gave (the CLI prints it
  as one `error:` line; the API raises it as the ValueError it is)."""
