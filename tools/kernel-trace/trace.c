/* A kernel timeline of a CUDA program, for machines where Nsight Systems cannot make a report
 * (the GPU hosts: nsys writes a .qdstrm there and has no importer). Loaded by the driver as an
 * injection library (CUDA_INJECTION64_PATH), it asks CUPTI for every kernel's activity record:
 * device, stream, start and end on the GPU's clock, and the correlation id of the launch that
 * ran it (one id for every kernel of one CUDA graph launch). CUPTI's concurrent-kernel tracing
 * does not serialize kernels, unlike ncu, so NCCL kernels that wait for each other across GPUs
 * run as they do untraced. Rows go to $KERNEL_TRACE_OUT as CSV at exit:
 *     device,stream,correlation,graph,start_ns,end_ns,name
 * Built by tools/kernel-trace/run.sh on the machine that runs it (CUPTI's record layout is the
 * one of that machine's header: KERNEL_RECORD names the newest CUpti_ActivityKernelN). */
#include <cupti_activity.h> /* only the activity API: cupti.h wants a cuda.h of its own version */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KERNEL_RECORD
#error "KERNEL_RECORD must name the header's newest CUpti_ActivityKernelN"
#endif

enum { BUFFER_BYTES = 16 << 20 };

static FILE *trace_out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
    (void)context, (void)stream, (void)size;
    CUpti_Activity *record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KERNEL_RECORD *k = (const KERNEL_RECORD *)record;
        fprintf(trace_out, "%u,%u,%u,%u,%llu,%llu,%s\n", k->deviceId, k->streamId,
                k->correlationId, k->graphId, (unsigned long long)k->start,
                (unsigned long long)k->end, k->name ? k->name : "?");
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(context, stream, &dropped);
    if (dropped) fprintf(stderr, "kernel-trace: CUPTI dropped %zu records\n", dropped);
    free(buffer);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    fclose(trace_out);
}

/* The driver calls this once, at cuInit, in the traced process. */
int InitializeInjection(void) {
    const char *path = getenv("KERNEL_TRACE_OUT");
    trace_out = fopen(path ? path : "kernel-trace.csv", "w");
    if (!trace_out) return 0;
    fprintf(trace_out, "device,stream,correlation,graph,start_ns,end_ns,name\n");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kernel-trace: CUPTI refused the kernel activity\n");
        return 0;
    }
    atexit(flush_at_exit);
    return 1;
}
