"""Worker: raises ValueError("boom") under torch's own @record, which writes
TORCHELASTIC_ERROR_FILE exactly as torchrun workers do."""
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise ValueError("boom")


if __name__ == "__main__":
    main()
