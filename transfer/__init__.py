"""kvtier.transfer — placeholder docstring, rewritten below."""
from .agent import Agent
from .descriptors import DescList, Prepared
from .errors import Fault, TransferError
from .handle import Transfer
from .memory import FileRegion, Region
from .metadata import AgentMetadata, RegionInfo
from .shm import ShmSegment
from .types import AgentConfig, BackendKind, MemKind, Notification, Op, State
