"""Uploading output_dir to the Hugging Face Hub (`push_to_hub`), with one-sentence errors for what a user can fix:
no token, no network, no permission."""

import os

from posttrain.errors import UserError


_HTTP_MODULES = ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")


class HubError(UserError, RuntimeError):
    """The push could not happen; the message says why and what to do."""


def repo_id(args) -> str:
    """hub_model_id, else the output directory's name (the Hub puts a bare name under the token's user)."""
    return args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))


def push_folder(args, folder: str, commit_message: str, token: str | None = None, revision: str | None = None,
                api=None) -> str:
    """Create the repository if needed and upload `folder` (checkpoints and the lock of a running run excluded).

    Args:
        api: a huggingface_hub.HfApi (default: a new one); tests pass a stand-in.
    Returns:
        The URL of the commit.
    """
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    token = token or args.hub_token or huggingface_hub.get_token()
    if token is None:
        raise HubError("push_to_hub needs a Hugging Face token and network access: run `hf auth login` (or set "
                       "HF_TOKEN or hub_token) on a machine that can reach huggingface.co.")
    api = api or huggingface_hub.HfApi()
    name = repo_id(args)
    try:
        repo = api.create_repo(name, token=token, private=args.hub_private_repo, exist_ok=True)
        return api.upload_folder(repo_id=getattr(repo, "repo_id", name), folder_path=folder,
                                 commit_message=commit_message, token=token, revision=revision or args.hub_revision,
                                 ignore_patterns=["checkpoint-*", "emergency-checkpoint-*", "*.tmp", "runs/*"])
    except OfflineModeIsEnabled as err:
        raise HubError(f"push_to_hub to {name!r}: the Hub is in offline mode (HF_HUB_OFFLINE=1); unset it to "
                       "push.") from err
    except HfHubHTTPError as err:
        raise HubError(f"push_to_hub to {name!r} was refused by the Hub ({str(err).splitlines()[0]}): check that "
                       "the token may write to that repository.") from err
    except Exception as err:
        # the HTTP client's transport errors (httpx, requests) and plain socket errors: no route to the Hub
        if not (isinstance(err, OSError) or type(err).__module__.split(".")[0] in _HTTP_MODULES):
            raise
        raise HubError(f"push_to_hub to {name!r} could not reach the Hub ({type(err).__name__}): it needs network "
                       "access to huggingface.co.") from err
