"""Named presets (models, serving). Data only: no engine logic lives here."""
