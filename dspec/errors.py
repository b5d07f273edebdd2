"""The errors dspec raises on purpose, in one hierarchy for the API and the scripts.

  DspecError                          every error below (the CLI prints each as one line)
    UserError(ValueError)             a bad argument, flag, config value or data given
    CheckpointError(ValueError)       a model file or directory that is missing, corrupt,
                                      of the wrong kind or mixed with another model's files
      FormatError                     ... a published drafter form not followed
                                      (`dspec.models.formats.drafter_dir`)
    OutputPathError(OSError)          an output path the output-path policy refuses
    WriteError(OSError)               an output that could not be written (disk full,
                                      read-only, permission denied; nothing was replaced)
    LockedError(OSError)              a directory another process is writing

`except ValueError` catches every bad-input error (arguments and files alike), `except
OSError` every output error; the last three live in `dspec.files`. The API also raises plain
ValueError for a bad argument (same meaning as UserError).
"""


class DspecError(Exception):
  """Base of every error dspec raises on purpose (see the module docstring)."""


class UserError(DspecError, ValueError):
  """An error caused by the command line, config or data the user gave (the CLI prints it
  as one `error:` line; the API raises it as the ValueError it is)."""


class CheckpointError(DspecError, ValueError):
  """A checkpoint is missing, incomplete, corrupt or does not fit what is asked of it."""
