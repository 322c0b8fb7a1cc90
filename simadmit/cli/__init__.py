from simadmit.cli.main import app

__all__ = ["app"]
