/* error.c -- version and error reporting. */
#include "internal.h"

GQP_API unsigned gqp_version(void)
{
    return GQP_VERSION_NUMBER;
}

GQP_API const char *gqp_version_string(void)
{
    return GQP_VERSION_STRING;
}

GQP_API const char *gqp_strerror(int code)
{
    switch (code) {
    case GQP_OK: return "success";
    case GQP_EINVAL: return "invalid argument";
    case GQP_ENOMEM: return "out of memory";
    case GQP_ESTATE: return "operation not allowed in the current state";
    case GQP_ERANGE: return "index or value out of range";
    case GQP_EHANDLE: return "not a live handle";
    case GQP_ENOTFOUND: return "no such entry";
    case GQP_ELIMIT: return "a configured limit was reached";
    default: return "unknown error";
    }
}

GQP_API const char *gqp_err_name(int code)
{
    switch (code) {
    case GQP_OK: return "GQP_OK";
    case GQP_EINVAL: return "GQP_EINVAL";
    case GQP_ENOMEM: return "GQP_ENOMEM";
    case GQP_ESTATE: return "GQP_ESTATE";
    case GQP_ERANGE: return "GQP_ERANGE";
    case GQP_EHANDLE: return "GQP_EHANDLE";
    case GQP_ENOTFOUND: return "GQP_ENOTFOUND";
    case GQP_ELIMIT: return "GQP_ELIMIT";
    default: return "GQP_EUNKNOWN";
    }
}
