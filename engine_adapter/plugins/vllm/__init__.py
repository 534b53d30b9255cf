"""kvtier under vLLM: `KVTierConnector` (a `KVConnectorBase_V1`). Importing this package
does not import vLLM; `register()` is the `vllm.general_plugins` entry point."""

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "engine_adapter.plugins.vllm.connector"


def register() -> None:
    """Make `kv_connector="KVTierConnector"` work without `kv_connector_module_path`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
